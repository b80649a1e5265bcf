"""``python -m xlaunch.tune``: the tuner. A Ctrl-C before it runs is exit 130, no traceback."""
import sys

try:
    from xlaunch.tune import main

    if __name__ == "__main__":
        main()
except KeyboardInterrupt:
    sys.exit(130)
