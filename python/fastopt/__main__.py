import sys

from fastopt.cli.main import main

sys.exit(main())
