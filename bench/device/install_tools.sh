#!/bin/bash
# Runs on the H200 machine, one call per part (.whl/tK): stashes the part; once all are there, checks the
# sha256 and installs the wheels into /tmp/tools (build_tools_payload.sh says what they are).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
read -r sum parts < "$here/payload.info"
mkdir -p /root/tstash && mv "$here"/part.* /root/tstash/ 2>/dev/null
[ -f /tmp/tools/.done ] && { echo "tools already in /tmp/tools"; exit 0; }
have=$(ls /root/tstash/part.* 2>/dev/null | wc -l)
[ "$have" -lt "$parts" ] && { echo "stashed tools part $have of $parts"; exit 0; }
cd /root/tstash && cat part.* > tools.tar && rm -f part.*
echo "$sum  tools.tar" | sha256sum -c - || { echo "checksum mismatch: rebuild the tools payload"; exit 1; }
mkdir -p /tmp/tools/w && tar -xf tools.tar -C /tmp/tools/w && rm -f tools.tar
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tools /tmp/tools/w/*.whl || exit 1
rm -rf /tmp/tools/w
echo 'export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/tools PATH=/tmp/tools/bin:$PATH' > /tmp/tools/env.sh
touch /tmp/tools/.done && echo "tools installed in /tmp/tools"
