import sys

from zend.cli import main

sys.exit(main())
