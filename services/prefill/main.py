"""The prefill worker's composition root: `python services/prefill/main.py [flags]` is `pdspark serve prefill [flags]`.

All the logic lives in the pdspark package (`pdspark.serving`); this file only hands over the process.
"""

import sys

from pdspark.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", "prefill", *sys.argv[1:]]))
