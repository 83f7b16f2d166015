import sys

from jlong.cli import main

sys.exit(main())
