import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tools"))  # s3servers: embedded S3 servers shared with the demo

from s3_fixtures import *  # noqa: E402,F401,F403 - session-scoped S3 servers
