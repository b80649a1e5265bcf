"""``python -m xlaunch``: the launcher. A Ctrl-C before it is imported is exit 130, no traceback."""
import sys

try:
    from xlaunch.launcher import main
except KeyboardInterrupt:
    sys.exit(130)

if __name__ == "__main__":
    main()
