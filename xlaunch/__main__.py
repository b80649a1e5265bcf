from xlaunch.launcher.cli import main

if __name__ == "__main__":
    main()
