"""Files :mod:`xlaunch.llm` reads: :mod:`~xlaunch.llm.files.checkpoint`, a Hugging Face safetensors checkpoint
directory read within bounds (the files transformers reads, every header checked)."""
