"""``python -m deltackpt.bench [options]`` is ``deltackpt bench [options]``."""

import sys

from deltackpt.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
