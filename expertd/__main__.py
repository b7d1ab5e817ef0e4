import sys

from expertd.cli.main import main

sys.exit(main())
