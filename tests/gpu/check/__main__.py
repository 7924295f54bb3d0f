import sys

from tests.gpu.check.cli import main

sys.exit(main())
