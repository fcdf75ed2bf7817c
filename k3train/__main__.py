import sys

from k3train.cli import main

sys.exit(main())
