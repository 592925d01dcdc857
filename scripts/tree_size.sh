#!/usr/bin/env bash
# The disk space of the tracked files (what a device call sends, beside its carried paths):
# the device tool refuses a working tree over 64 MiB. Keep raw results xz-compressed and plots
# palette-quantized (pngquant) to stay under it.
set -euo pipefail
cd "$(dirname "$0")/.."
kib=$(git ls-files -z | xargs -0 du -ck | tail -1 | cut -f1)
echo "tracked files: $((kib / 1024)) MiB of the device's 64 MiB ($kib KiB)"
git ls-files -z | xargs -0 du -k | awk '{split($2, p, "/"); d = p[1] "/" p[2] "/" p[3]; s[d] += $1}
  END {for (d in s) printf "%8d KiB  %s\n", s[d], d}' | sort -n | tail -5
