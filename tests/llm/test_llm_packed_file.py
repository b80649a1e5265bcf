"""xlaunch.llm.save_packed and from_pretrained of the packed file: identical logits in a fresh process, two
processes (that one and this) sharing the mapped pages (smaps), and stale, truncated or malformed files
refused with one line."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from llm_models import VOCAB, read_manifest, rewrite_manifest, tiny  # noqa: E402

import xlaunch.llm as llm  # noqa: E402
from xlaunch.llm.packed_file import PackedFileError, kernel_level  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]
REPO = Path(__file__).resolve().parents[2]
IDS = [[5, 17, 300, 42, 7, 99, 250, 1, 64, 128, 511, 3]]

CHILD = r"""
import sys, torch
import xlaunch.llm as llm
model = llm.from_pretrained(sys.argv[1])
with torch.no_grad():
    torch.save(model(torch.tensor(%s)).logits, sys.argv[2])
print("ready", flush=True)
sys.stdin.read()
""" % IDS


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """(checkpoint directory, packed file, logits of the streamed model): INT8, so scales are stored too."""
    root = tmp_path_factory.mktemp("packed")
    tiny("llama", seed=2).save_pretrained(root / "checkpoint", safe_serialization=True)
    model = llm.from_pretrained(root / "checkpoint", weights="int8")
    path = llm.save_packed(model, root / "model.xlp")
    with torch.no_grad():
        return root / "checkpoint", path, model(torch.tensor(IDS)).logits


def _mapping(pid: int, path: Path) -> dict:
    """Rss, Pss and shared pages (kB) of every mapping of ``path`` in process ``pid`` (bench/_procmem's reader)."""
    from bench_modules import load

    smaps = Path(f"/proc/{pid}/smaps").read_text()
    return load("_procmem").mapping_kib(smaps, str(path), keys=("Rss", "Pss", "Shared_Clean", "Shared_Dirty"))


@pytest.fixture(scope="module")
def children(packed, tmp_path_factory):
    """A fresh process that mapped the packed file and ran it, and this process with the file mapped too: the
    child's logits, and both processes' smaps of the file while both hold it (one fresh process is enough to
    prove a fresh load; this one is the second sharer, and spares a second import of torch and transformers)."""
    _, path, _ = packed
    out = tmp_path_factory.mktemp("children") / "logits.pt"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(out)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read()[-3000:] if proc.poll() is not None else line
        here = llm.from_pretrained(path)
        with torch.no_grad():
            here(torch.tensor(IDS))          # reads every weight, as the child did
        maps = [_mapping(proc.pid, path), _mapping(os.getpid(), path)]
        del here
    finally:
        proc.communicate(timeout=60)
    assert proc.returncode == 0
    return [torch.load(out)], maps


def test_a_fresh_process_gets_identical_logits_from_the_packed_file(packed, children):
    logits, _ = children
    for got in logits:
        assert torch.equal(got, packed[2])


def test_two_processes_share_the_mapped_file_pages(packed, children):
    _, maps = children
    for found in maps:
        shared = found["Shared_Clean"] + found["Shared_Dirty"]
        assert found["Rss"] > 0 and shared > 0, maps
        assert found["Pss"] <= 0.75 * found["Rss"], maps     # each process is charged about half of each page


def test_a_loaded_file_is_mapped_not_copied(packed):
    _, path, logits = packed
    model = llm.from_pretrained(path)
    private = llm.from_pretrained(path, private=True)
    with torch.no_grad():
        assert torch.equal(model(torch.tensor(IDS)).logits, logits)
        assert torch.equal(private(torch.tensor(IDS)).logits, logits)
    assert _mapping(os.getpid(), path)["Rss"] > 0          # the weights were read where the file is mapped


@pytest.mark.parametrize("tied", [False, True], ids=["16-bit-table", "tied"])
def test_an_embedding_round_trips_as_a_16_bit_table_or_as_the_tied_lm_head(tmp_path, tied):
    checkpoint = tiny("llama", seed=5, tie_word_embeddings=tied).to(torch.bfloat16)
    checkpoint.save_pretrained(tmp_path / "checkpoint", safe_serialization=True)
    model = llm.from_pretrained(tmp_path / "checkpoint", dtype=torch.float32, weights="int4", group_size=32)
    path = llm.save_packed(model, tmp_path / "model.xlp")
    manifest = read_manifest(path)
    assert manifest["embedding"] == ("lm_head" if tied else "table") and ("embed" in manifest["tensors"]) != tied
    again = llm.from_pretrained(path)
    if tied:
        assert again.model.embed_tokens.weight is None and again.model.embed_tokens.lm_head is again.lm_head
    else:
        assert again.model.embed_tokens.weight.dtype == torch.bfloat16
    assert again.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(again(torch.tensor(IDS)).logits, model(torch.tensor(IDS)).logits)


def _refused(path, match: str, **kwargs) -> str:
    with pytest.raises(PackedFileError, match=match) as info:
        llm.from_pretrained(path, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_truncated_file_is_refused_with_one_line(packed, tmp_path):
    _, path, _ = packed
    data = path.read_bytes()
    for size in (len(data) - 1, len(data) // 2, 1000, 10):
        (tmp_path / "cut.xlp").write_bytes(data[:size])
        _refused(tmp_path / "cut.xlp", "truncated|not an xlaunch")


def test_another_kernel_level_or_format_is_refused_then_rebuilt_from_the_source(packed, tmp_path):
    checkpoint, path, logits = packed
    other = "avx2" if kernel_level() != "avx2" else "avx512"
    stale = rewrite_manifest(path, tmp_path / "stale.xlp", lambda m: m["kernel"].update(level=other))
    message = _refused(stale, "kernel level")
    assert other in message and kernel_level() in message
    _refused(rewrite_manifest(path, tmp_path / "layout.xlp", lambda m: m["kernel"].update(fingerprint="0" * 16)),
             "kernel fingerprint")
    _refused(rewrite_manifest(path, tmp_path / "version.xlp", lambda m: m.update(version=99)), "format version 99")
    rebuilt = llm.from_pretrained(stale, source=checkpoint, weights="int8")
    with torch.no_grad():
        assert torch.equal(rebuilt(torch.tensor(IDS)).logits, logits)
    assert json.loads(stale.read_bytes()[16:16 + struct.unpack("<Q", stale.read_bytes()[8:16])[0]])[
        "kernel"]["level"] == kernel_level()
    _refused(stale, "holds weights='int8'", weights="int4")


def test_an_edited_generation_config_in_the_source_rebuilds_the_file(packed, tmp_path):
    """The source's digest left generation_config.json out: the file kept the old eos_token_id and sampling
    settings after the checkpoint's were edited (or removed), while the checkpoint loaded directly had the new."""
    import shutil

    checkpoint, _, logits = packed
    source, path = shutil.copytree(checkpoint, tmp_path / "source"), tmp_path / "model.xlp"
    assert llm.from_pretrained(path, source=source, weights="int8").generation_config.eos_token_id == 2
    settings = json.loads((source / "generation_config.json").read_text())
    (source / "generation_config.json").write_text(json.dumps(dict(settings, eos_token_id=7, temperature=0.3,
                                                                   do_sample=True)))
    for model in (llm.from_pretrained(path, source=source, weights="int8"), llm.from_pretrained(path)):
        assert (model.generation_config.eos_token_id, model.generation_config.temperature) == (7, 0.3)
    (source / "generation_config.json").unlink()
    model = llm.from_pretrained(path, source=source, weights="int8")
    assert model.generation_config.temperature == llm.from_pretrained(source, weights="int8").generation_config.temperature
    with torch.no_grad():
        assert torch.equal(model(torch.tensor(IDS)).logits, logits)


def test_a_hub_name_is_one_line_saying_it_is_not_downloaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hub = "No such file or directory\\); a Hugging Face Hub name is not downloaded: xlaunch.llm reads local files only$"
    _refused("meta-llama/Llama-3.2-1B", hub)
    with pytest.raises(PackedFileError, match=hub):
        llm.load_decoder("meta-llama/Llama-3.2-1B")
    _refused(tmp_path / "missing", "No such file or directory\\)$")


def test_the_source_digest_is_the_checkpoint_as_it_was_read(packed, tmp_path):
    """save_packed digested the source when it was called: a checkpoint changed since the load (a newer revision
    downloaded over it) was recorded as what the file holds, and from_pretrained(path, source=...) served the old
    weights for it; a checkpoint removed since could not be saved at all."""
    import shutil

    from safetensors.torch import load_file, save_file

    checkpoint, _, logits = packed
    source = shutil.copytree(checkpoint, tmp_path / "source")
    model = llm.from_pretrained(source, weights="int8")
    tensors = load_file(str(source / "model.safetensors"))
    save_file({name: t * 1.5 for name, t in tensors.items()}, str(source / "model.safetensors"), metadata={"format": "pt"})
    path = llm.save_packed(model, tmp_path / "model.xlp")
    ids = torch.tensor(IDS)
    with torch.no_grad():
        expected = llm.from_pretrained(source, weights="int8")(ids).logits
        assert not torch.equal(expected, logits)
        assert torch.equal(llm.from_pretrained(path, source=source, weights="int8")(ids).logits, expected)   # rebuilt
    again = llm.from_pretrained(path)      # the rebuilt file's model keeps its digest: saved, it stands for source
    shutil.rmtree(source)
    copy = llm.save_packed(again, tmp_path / "copy.xlp")
    assert read_manifest(copy)["source"] == read_manifest(path)["source"]


def test_malformed_files_get_one_clear_error(packed, tmp_path):
    _, path, _ = packed
    (tmp_path / "junk.xlp").write_bytes(b"not a packed file at all")
    _refused(tmp_path / "junk.xlp", "no XLLMPACK header\\)$")
    checkpoint = packed[0]
    for name in ("model.safetensors", "config.json"):     # a checkpoint's file, not its folder: said so
        _refused(checkpoint / name, "no XLLMPACK header\\); from_pretrained takes the checkpoint's folder$")
    (tmp_path / "huge.xlp").write_bytes(b"XLLMPACK" + struct.pack("<Q", 1 << 40) + b"{}")
    _refused(tmp_path / "huge.xlp", "malformed")
    (tmp_path / "json.xlp").write_bytes(b"XLLMPACK" + struct.pack("<Q", 4) + b"{{{{")
    _refused(tmp_path / "json.xlp", "not valid JSON")
    outside = rewrite_manifest(path, tmp_path / "outside.xlp",
                       lambda m: m["tensors"]["embed"].update(offset=m["tensors"]["embed"]["offset"] + (1 << 30)))
    _refused(outside, "truncated: tensor 'embed'")
    header = rewrite_manifest(path, tmp_path / "header.xlp", lambda m: m["tensors"]["embed"].update(offset=0))
    _refused(header, "inside the header")
    shape = rewrite_manifest(path, tmp_path / "shape.xlp",
                     lambda m: m["tensors"]["lm_head.weight"].update(shape=[1, 1], nbytes=1))
    _refused(shape, "lm_head.weight")
    kind = rewrite_manifest(path, tmp_path / "dtype.xlp", lambda m: m["tensors"]["lm_head.weight"].update(dtype="uint8"))
    _refused(kind, "'lm_head.weight' is uint8, not int8")
    untied = rewrite_manifest(path, tmp_path / "untied.xlp", lambda m: m.update(embedding="lm_head"))
    _refused(untied, "neither a table nor a tied lm_head")      # the packed model's embeddings are not tied
    no_table = rewrite_manifest(path, tmp_path / "no-table.xlp", lambda m: m["tensors"].pop("embed"))
    _refused(no_table, "tensor 'embed' is missing")
    _refused("/dev/null", "not a regular file")


def test_manifest_records_of_the_wrong_kind_get_one_clear_error_from_both_loaders(packed, tmp_path):
    """Found by mutating one manifest value at a time: these reached AttributeError, TypeError or transformers'
    own validation errors, and overlapping tensors loaded into non-finite logits."""
    _, path, _ = packed

    def both(target, match):
        _refused(target, match)
        with pytest.raises(PackedFileError, match=match) as info:
            llm.load_decoder(target)
        assert "\n" not in str(info.value)

    both(rewrite_manifest(path, tmp_path / "kernel.xlp", lambda m: m.update(kernel=-1)), "kernel record is malformed")
    norm = "layers.0.post_attention_norm"
    overlap = rewrite_manifest(path, tmp_path / "overlap.xlp", lambda m: m["tensors"][norm].update(
        offset=max(e["offset"] for n, e in m["tensors"].items() if e["nbytes"] > 8192 and n != norm)))
    both(overlap, f"tensors .* and .* overlap")
    for change in ({"generation_config": "int8"}, {"generation_config": {"watermarking_config": True}}):
        _refused(rewrite_manifest(path, tmp_path / "generation.xlp", lambda m: m.update(change)),
                 "model or generation config is malformed")
    with pytest.raises(PackedFileError, match="generation_config is malformed"):
        llm.load_decoder(rewrite_manifest(path, tmp_path / "generation.xlp", lambda m: m.update(generation_config=[1])))
    _refused(rewrite_manifest(path, tmp_path / "config.xlp", lambda m: m["config"].update(vocab_size=1.5)),
             "model or generation config is malformed")
    # transformers' validation error, whole: it was cut at "Validation error for field 'hidden_size':"
    _refused(rewrite_manifest(path, tmp_path / "config.xlp", lambda m: m["config"].update(hidden_size="128")),
             "malformed \\(.*field 'hidden_size': TypeError: Field 'hidden_size' expected int, got str")
    source = rewrite_manifest(path, tmp_path / "source.xlp", lambda m: m.update(source=[1]))
    assert llm.from_pretrained(source) is not None             # the source is a record, not needed to load


def test_a_fifo_in_the_source_is_refused_without_blocking(packed, tmp_path):
    """The source's digest read every *.safetensors and config.json as they came: a FIFO with no writer blocked it for
    good (fifos.py keeps a regression from hanging the worker)."""
    import shutil

    from fifos import fifo_with_late_writer

    checkpoint, path, logits = packed
    source = tmp_path / "source"
    shutil.copytree(checkpoint, source)
    with fifo_with_late_writer(source / "extra.safetensors"):      # beside model.safetensors: not read at all
        with torch.no_grad():
            assert torch.equal(llm.from_pretrained(path, source=source, weights="int8")(torch.tensor(IDS)).logits,
                               logits)
    (source / "model.safetensors").unlink()
    with fifo_with_late_writer(source / "model.safetensors"):
        message = _refused(path, "model.safetensors is a FIFO, not a regular file", source=source, weights="int8")
    assert "\n" not in message


def test_save_packed_never_writes_through_a_link_planted_at_its_partial_file(packed, tmp_path, monkeypatch):
    """The temporary file's name is random; a link planted at the name it draws (forced here) is passed by."""
    from xlaunch import userfiles

    checkpoint, path, logits = packed
    model = llm.from_pretrained(path)
    target, victim = tmp_path / "model.xlp", tmp_path / "victim"
    victim.write_text("keep me")
    planted = tmp_path / f".model.xlp.{os.getpid()}.{'00' * 4}.tmp"
    planted.symlink_to(victim)
    draws = iter([b"\0" * 4])
    real = userfiles.os.urandom
    monkeypatch.setattr(userfiles.os, "urandom", lambda n: next(draws, None) or real(n))
    llm.save_packed(model, target)
    monkeypatch.undo()
    assert victim.read_text() == "keep me" and planted.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model.xlp", "victim", planted.name])
    with torch.no_grad():
        assert torch.equal(llm.from_pretrained(target)(torch.tensor(IDS)).logits, logits)


def test_threads_saving_one_file_at_once_each_write_it_whole(packed, tmp_path):
    """Every writer of a process shared one temporary name (.model.xlp.PID.partial): one removed another's file
    and renamed a half-written one over the target, the others failed (cannot write ... No such file)."""
    import threading

    _, path, logits = packed
    model = llm.from_pretrained(path)
    target, failures = tmp_path / "model.xlp", []

    def save() -> None:
        try:
            llm.save_packed(model, target)
        except Exception as error:      # noqa: BLE001 - recorded, asserted below
            failures.append(error)

    for _ in range(3):
        threads = [threading.Thread(target=save) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with torch.no_grad():
            assert torch.equal(llm.from_pretrained(target)(torch.tensor(IDS)).logits, logits)
    assert not failures and [p.name for p in tmp_path.iterdir()] == ["model.xlp"]


def test_a_killed_writers_temporary_file_is_removed_by_the_next_save(packed, tmp_path):
    """A save_packed killed mid-write (SIGKILL, the OOM killer) left its temporary file, the packed file's size,
    and every kill one more. The next save removes those of a process gone from this machine and untouched for
    15 minutes; a live writer's, a recent one (a writer on another machine sharing the folder) and links stay."""
    _, path, _ = packed
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    old = (tmp_path / f".model.xlp.{dead}.0badf00d.tmp", tmp_path / f".model.xlp.{os.getpid()}.0badf00d.tmp")
    recent = tmp_path / f".model.xlp.{dead}.00c0ffee.tmp"
    link, other = tmp_path / f".model.xlp.{dead}.0000dead.tmp", tmp_path / f".other.xlp.{dead}.0badf00d.tmp"
    for file in (*old, recent, other):
        file.write_bytes(b"x" * 4096)
    link.symlink_to(old[0])
    for file in (*old, other):
        os.utime(file, (1, 1))
    os.utime(link, (1, 1), follow_symlinks=False)
    llm.save_packed(llm.from_pretrained(path), tmp_path / "model.xlp")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model.xlp", old[1].name, recent.name, link.name,
                                                                  other.name])


def test_an_fp32_model_of_bf16_values_round_trips_with_its_bf16_storage(tmp_path):
    from xlaunch.llm import native

    if native.ops() is None:     # not built, or XLAUNCH_LLM_NATIVE=0
        pytest.skip("bf16 storage under fp32 activations is the compiled kernels' layout; they are not in use here")
    tiny("llama", seed=6).to(torch.bfloat16).save_pretrained(tmp_path / "bf16", safe_serialization=True)
    model = llm.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.lm_head.layout == "native"
    loaded = llm.from_pretrained(llm.save_packed(model, tmp_path / "fp32.xlp"))
    assert loaded.lm_head.weight.dtype == torch.bfloat16 and loaded.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(loaded(torch.tensor(IDS)).logits, model(torch.tensor(IDS)).logits)


def test_save_packed_never_replaces_a_device_fifo_or_folder(packed, tmp_path):
    """It renamed its finished file over whatever was at the path: as root, a device node too (examples/llm.py
    --packed /dev/null replaced the machine's /dev/null with a regular file). A private FIFO and folder stand in."""
    _, path, _ = packed
    model = llm.from_pretrained(path)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    for name in ("fifo", "folder"):
        with pytest.raises(PackedFileError, match=f"{name} is not a regular file \\(never replaced\\)"):
            llm.save_packed(model, tmp_path / name)
    assert (tmp_path / "fifo").is_fifo() and (tmp_path / "folder").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "folder"]     # no partial file left


FULL_DISK_PROGRAM = """
import os, resource, signal, sys
import xlaunch.llm as llm
from xlaunch.llm.packed_file import PackedFileError

model = llm.from_pretrained(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)               # a write past the limit fails with EFBIG, as ENOSPC would
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    llm.save_packed(model, sys.argv[2])
except PackedFileError as error:
    print(error)
"""


def test_a_folder_that_cannot_take_the_file_is_one_line_naming_it(packed, tmp_path):
    """No such folder (a typo), or a disk that fills up: an OSError naming the hidden partial file
    (.model.xlp.PID.partial), from save_packed and from from_pretrained(path, source=...); now one line naming
    the file asked for, and no partial file left."""
    checkpoint, path, _ = packed
    model = llm.from_pretrained(path)
    missing = tmp_path / "no-such-folder" / "model.xlp"
    for write in (lambda: llm.save_packed(model, missing),
                  lambda: llm.from_pretrained(missing, source=checkpoint, weights="int8")):
        with pytest.raises(PackedFileError, match=f"^xlaunch.llm.save_packed: cannot write {missing} \\(No such file"):
            write()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", FULL_DISK_PROGRAM, str(path), str(tmp_path / "model.xlp")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr[-3000:]
    assert done.stdout.strip() == f"xlaunch.llm.save_packed: cannot write {tmp_path / 'model.xlp'} (File too large)"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("path,error,match", [(None, TypeError, "path must be a str or os.PathLike, not NoneType"),
                                              (b"model.xlp", TypeError, "path must be a str or os.PathLike, not bytes"),
                                              ("", ValueError, "path is empty")])
def test_a_packed_path_that_is_no_path_is_one_line_naming_it(packed, path, error, match):
    """None or bytes failed inside pathlib, naming no argument; '' became the working directory ('.')."""
    _, packed_path, _ = packed
    model = llm.from_pretrained(packed_path)
    for call, name in ((lambda: llm.save_packed(model, path), "save_packed"), (lambda: llm.load_decoder(path), "load_decoder")):
        with pytest.raises(error, match=f"^xlaunch.llm.{name}: {match}$"):
            call()


@pytest.mark.parametrize("arguments,match", [(dict(dtype="float32"), "dtype must be .*not 'float32'"),
                                             (dict(dtype=torch.float16), "dtype must be .*not torch.float16"),
                                             (dict(weights="int3"), "weights must be .*not 'int3'"),
                                             (dict(weights="int4", group_size=100), "group_size must be .*not 100")])
def test_an_argument_no_file_could_hold_is_named_not_read_as_another_precision(packed, arguments, match):
    """dtype="float32" (a str) on a packed file read "holds dtype='fp32', not the 'float32' asked for"; on a
    checkpoint the line began "xlaunch.llm.optimize:"."""
    checkpoint, path, _ = packed
    for call, name in ((lambda: llm.from_pretrained(path, **arguments), "from_pretrained"),
                       (lambda: llm.from_pretrained(checkpoint, **arguments), "from_pretrained"),
                       (lambda: llm.load_decoder(path, **arguments), "load_decoder")):
        with pytest.raises(ValueError, match=f"^xlaunch.llm.{name}: {match}") as info:
            call()
        assert not isinstance(info.value, PackedFileError)


def test_a_model_loaded_from_a_relative_path_saves_after_a_chdir(packed, tmp_path, monkeypatch):
    """The source was kept as given ('checkpoint'): after os.chdir, save_packed read another folder's files for its
    digest, or failed ("cannot read checkpoint/config.json")."""
    checkpoint, _, logits = packed
    monkeypatch.chdir(checkpoint.parent)
    model = llm.from_pretrained(checkpoint.name, weights="int8")
    monkeypatch.chdir(tmp_path)
    path = llm.save_packed(model, tmp_path / "model.xlp")
    assert read_manifest(path)["source"]["path"] == str(checkpoint)
    written = path.stat().st_mtime_ns
    with torch.no_grad():      # the digest is the checkpoint's: the file stands for it, not rebuilt
        assert torch.equal(llm.from_pretrained(path, source=checkpoint, weights="int8")(torch.tensor(IDS)).logits, logits)
    assert path.stat().st_mtime_ns == written
