#!/bin/bash
# One poll of a background run (README.md here, "Long runs"): every 20 s, OUT (the steps' printouts) and OUT.log
# archived into $OUT/<name>.tgz, until OUT/done says "all done" or ROUNDS rounds pass; then OUT/done is printed.
# Only the printouts: a file over 16 MiB does not come back at all, so the archive is checked and, when too big,
# replaced by one of each printout's last 64 KiB.
#   bash bench/device/poll.sh /tmp/nv [ROUNDS]        (ROUNDS x 20 s within the call's limit; default 25)
set -u
RUN=${1:?usage: poll.sh OUT [ROUNDS]}
name=$(basename "$RUN")
limit=$((15 * 1024 * 1024))
for ((i = 0; i < ${2:-25}; i++)); do
  sleep 20
  tar -czf "$OUT/$name.tgz" -C "$(dirname "$RUN")" "$name" "$name.log" 2> /dev/null
  if [ "$(stat -c %s "$OUT/$name.tgz")" -gt $limit ]; then
    for f in "$RUN"/* "$RUN.log"; do echo "== $f"; tail -c 65536 "$f"; done 2> /dev/null | gzip > "$OUT/$name.tails.gz"
    rm -f "$OUT/$name.tgz"
  fi
  grep -q "all done" "$RUN/done" 2> /dev/null && break
done
cat "$RUN/done" 2> /dev/null
