import sys

from logdiff.cli.main import main

sys.exit(main())
