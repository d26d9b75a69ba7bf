import sys

from nanguard.cli import main

sys.exit(main())
