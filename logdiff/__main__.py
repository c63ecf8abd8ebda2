import sys

from logdiff.cli import main

sys.exit(main())
