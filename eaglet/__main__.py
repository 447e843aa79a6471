from .cli import main

if __name__ == "__main__":  # not when a spawned engine process (server/remote.py) imports the main module
    import sys

    sys.exit(main())
