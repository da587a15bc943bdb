#!/usr/bin/env bash
# Make sure the system programs a target needs are present, installing them when we can.
#
#   bash tools/system_deps.sh npm            (make book: npm fetches the site's JavaScript)
#   bash tools/system_deps.sh npm chromium   (make test: chromium runs the browser test)
#   bash tools/system_deps.sh bwrap          (make grade: bubblewrap seals each student's notebook)
#   bash tools/system_deps.sh chromium pdftoppm   (make test-pdf: chromium prints, pdftoppm draws pages)
#
# A missing program is installed with apt-get when this runs as root on a Debian-like
# system (a container, a CI machine); with sudo when sudo works without a password.
# Otherwise the script stops at once and prints the exact command to run. It never
# lets a part of the suite be skipped silently.
set -euo pipefail

declare -A package=([npm]=npm [chromium]=chromium [bwrap]=bubblewrap [pdftoppm]=poppler-utils)
missing=()
for program in "$@"; do
  [ -n "${package[$program]:-}" ] || { echo "system_deps.sh: unknown program '$program'" >&2; exit 2; }
  command -v "$program" >/dev/null 2>&1 || missing+=("${package[$program]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0

# fonts-dejavu-core: the fonts the browser test renders pages with.
install=(apt-get install -y -qq --no-install-recommends "${missing[@]}" fonts-dejavu-core)
if ! command -v apt-get >/dev/null 2>&1; then
  echo "system_deps.sh: missing ${missing[*]}, and this is not a Debian-like system (no apt-get)." >&2
  echo "Install ${missing[*]} with your system's package manager, then run make again." >&2
  exit 1
fi
if [ "$(id -u)" = 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  echo "system_deps.sh: missing ${missing[*]}. Install it with:" >&2
  echo "    sudo apt-get update && sudo ${install[*]}" >&2
  exit 1
fi
echo "system_deps.sh: installing ${missing[*]} with apt-get"
"${sudo[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" "${install[@]}" >/dev/null
for program in "$@"; do
  command -v "$program" >/dev/null 2>&1 || { echo "system_deps.sh: $program still missing after apt-get" >&2; exit 1; }
done
