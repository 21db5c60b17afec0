"""Print ``export UV_...=...`` lines that give uv the package sources pip is configured with here.

.ci/run installs the nox tiers' virtualenvs with uv (nox's ``uv`` backend): it resolves and links from one
cache, where pip unpacked torch into each of six virtualenvs again (about 100 s a tier, on the CPU the tier
before it was testing on). uv reads no pip.conf, so pip's find-links, indexes and constraints (``pip config
list``: files and ``PIP_*`` variables alike) are handed to it as its own variables; a ``UV_*`` variable
already set is kept. uv takes the best version over every index, as pip does (``unsafe-best-match``; uv's
own default stops at the first index that has the package).
"""

import ast
import os
import shlex
import subprocess
import sys

#: pip's option -> (uv's variable, the separator of uv's list)
OPTIONS = {
    "find-links": ("UV_FIND_LINKS", ","),
    "index-url": ("UV_INDEX_URL", " "),
    "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "constraint": ("UV_CONSTRAINT", " "),
    "cert": ("SSL_CERT_FILE", " "),
}

listed = subprocess.run(
    [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
).stdout
values: dict[str, list[str]] = {}
for line in listed.splitlines():
    key, _, value = line.partition("=")
    option = key.rpartition(".")[2]
    if option in OPTIONS and value:
        for item in ast.literal_eval(value).split():
            if item not in values.setdefault(option, []):
                values[option].append(item)

settings = {"UV_INDEX_STRATEGY": "unsafe-best-match", "UV_PYTHON_DOWNLOADS": "never"}
for option, items in values.items():
    variable, separator = OPTIONS[option]
    settings[variable] = separator.join(items)
for variable, value in settings.items():
    if variable not in os.environ:
        print(f"export {variable}={shlex.quote(value)}")
