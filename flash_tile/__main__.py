import sys

from flash_tile.cli import main

sys.exit(main())
