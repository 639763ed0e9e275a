import sys

from specdraft.cli.main import main

sys.exit(main())
