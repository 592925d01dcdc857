#!/usr/bin/env bash
# The disk space of the tracked files (what a device call sends, beside its carried paths):
# the device tool refuses a working tree over 64 MiB. Keep raw results xz-compressed and plots
# palette-quantized (pngquant) to stay under it.
set -euo pipefail
cd "$(dirname "$0")/.."
# (apparent sizes, the bytes that travel: du's default counts whole disk blocks, ~2 MiB more here)
kib=$(( $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) / 1024 ))
echo "tracked files: $((kib / 1024)) MiB of the device's 64 MiB ($kib KiB)"
for carried in .whl .traces; do
  [ -e "$carried" ] && echo "  + $carried (when carried): $(( $(du -sb "$carried" | cut -f1) / 1024 )) KiB"
done
git ls-files -z | xargs -0 du -k --apparent-size | awk '{split($2, p, "/"); d = p[1] "/" p[2] "/" p[3]; s[d] += $1}
  END {for (d in s) printf "%8d KiB  %s\n", s[d], d}' | sort -n | tail -5
