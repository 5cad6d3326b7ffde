import sys

from graphcp.cli import main

sys.exit(main())
