import sys

from hangwatch.cli import main

# Guarded: multiprocessing's forkserver/spawn children re-import the main
# module (as __mp_main__) and must not run the CLI again.
if __name__ == "__main__":
    sys.exit(main())
