"""``python -m ttc_testing.scenarios NAME [key=value ...]``: one scenario, its result as one ``RESULT`` JSON line."""

import sys

from torch_threadsafe_compile import selftest
from ttc_testing.scenarios import MODULE

sys.exit(selftest._main(sys.argv[1:], module=MODULE))
