#!/usr/bin/env bash
# The second corpus of the quality benchmark (docs/outer.md): Python 3.11's documentation
# sources (reStructuredText, 497 files, 12 MB of English technical prose), from Debian's
# python3.11-doc package, unpacked without installing it. A set-up step, like the shipped
# corpus's pip install: nothing is downloaded when a run starts.
# Usage: scripts/get_corpus_python_docs.sh [DEST]   (default runs/corpora/python-docs-3.11)
# Then:  .venv/bin/python scripts/bench_quality.py --set data.path=$PWD/runs/corpora/python-docs-3.11 ...
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-runs/corpora/python-docs-3.11}"
if [ -d "$dest" ] && [ -n "$(ls -A "$dest")" ]; then
    echo "$dest: already there"
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download python3.11-doc >/dev/null)
dpkg -x "$tmp"/python3.11-doc_*.deb "$tmp/x"
mkdir -p "$dest"
cp -r "$tmp/x/usr/share/doc/python3.11/html/_sources/." "$dest/"
echo "$dest: $(find "$dest" -type f | wc -l) files, $(du -sh "$dest" | cut -f1)"
