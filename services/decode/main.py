"""The decode worker's composition root: `python services/decode/main.py [flags]` is `pdspark serve decode [flags]`.

All the logic lives in the pdspark package (`pdspark.serving`); this file only hands over the process.
"""

import sys

from pdspark.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", "decode", *sys.argv[1:]]))
