"""Print the README's two set-up commands, one per line: the first two ```bash blocks of README.md (the
quickstart with no extras, then the test suite). .ci/run runs them exactly as written, so CI and the README
cannot drift apart."""

import re
import sys
from pathlib import Path

blocks = re.findall(r"^```bash\n(.*?)^```", Path("README.md").read_text(), re.S | re.M)
commands = [block.strip() for block in blocks[:2]]
one_line = all(c.startswith("python3 -m venv .venv && ") and "\n" not in c for c in commands)
if len(commands) != 2 or not one_line:
    sys.exit(f"README.md: the first two ```bash blocks must be the one-line set-up commands, got {commands}")
if "[" in commands[0]:
    sys.exit(f"README.md: the first command must install no extras, got {commands[0]}")
print(*commands, sep="\n")
