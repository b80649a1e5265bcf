"""``python -m xlaunch``: the launcher. A Ctrl-C before it runs is exit 130, no traceback."""
import sys

try:
    from xlaunch.launcher import main

    if __name__ == "__main__":
        main()
except KeyboardInterrupt:
    sys.exit(130)
