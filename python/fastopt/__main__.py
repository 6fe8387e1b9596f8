import sys

from fastopt.cli import main

sys.exit(main())
