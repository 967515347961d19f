"""An exclusion command for tests: appends the argv it was given, as one JSON line, to argv[1]."""

from __future__ import annotations

import json
import os
import sys

from hangwatch.config import env_var

if __name__ == "__main__":
    with open(sys.argv[1], "a", encoding="utf-8") as f:
        f.write(
            json.dumps({"argv": sys.argv[2:], "token": os.environ.get(env_var("token"))}) + "\n"
        )
    print(f"cordoned {sys.argv[2]}")
