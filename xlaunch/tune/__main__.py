"""``python -m xlaunch.tune``."""
from xlaunch.tune.cli import main

if __name__ == "__main__":
    main()
