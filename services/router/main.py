"""The router's composition root: `python services/router/main.py [flags]` is `pdspark serve router [flags]`.

All the logic lives in the pdspark package (`pdspark.router`); this file only hands over the process.
"""

import sys

from pdspark.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", "router", *sys.argv[1:]]))
