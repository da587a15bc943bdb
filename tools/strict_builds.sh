#!/usr/bin/env bash
# The two strict HTML builds (-W -n --keep-going): the book into _build/html, the student edition
# into _build/student/_build/html, side by side.
#
#   bash tools/strict_builds.sh           build both (from scratch); on success record the tree they were built from
#   bash tools/strict_builds.sh --reuse   the same, unless both were built strictly from the tree as it is now
#                                         (make test builds them; make test-pdf, run after it, reuses them)
#   bash tools/strict_builds.sh --digest  print the digest of the tree (what a build is recorded against)
#   bash tools/strict_builds.sh --record DIGEST   record that both builds passed for the tree of DIGEST
#
# The tree's digest is that of every file git tracks or would track (untracked files not ignored
# included) with its contents as they are on disk; outside a git checkout there is none, and nothing is reused.
set -u
cd "$(dirname "$0")/.."
BIN=.venv/bin
STAMP=_build/strict-builds.sha256

digest() {
  git rev-parse --is-inside-work-tree >/dev/null 2>&1 || return 0
  git ls-files -z --cached --others --exclude-standard | LC_ALL=C sort -z |
    xargs -0 sha256sum -- 2>/dev/null | sha256sum | cut -d' ' -f1
}
record() {
  [ -n "$1" ] && echo "$1" >"$STAMP"
}

case "${1:-}" in
  --digest) digest; exit 0 ;;
  --record) record "${2-}"; exit 0 ;;      # an empty digest (no git checkout) records nothing
  --reuse|"") ;;
  *) echo "strict_builds.sh: unknown option ${1}; expected --reuse, --digest or --record DIGEST" >&2; exit 2 ;;
esac

tree=$(digest)
if [ "${1:-}" = --reuse ] && [ -n "$tree" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$tree" ] \
    && [ -f _build/html/index.html ] && [ -f _build/student/_build/html/index.html ]; then
  echo "strict builds: both editions were built strictly from this tree (tree digest ${tree:0:12}): reused"
  exit 0
fi
rm -rf _build/html _build/.doctrees _build/jupyter_execute _build/student "$STAMP"
$BIN/python tools/student_toc.py _toc.yml _build/student_toc.yml || exit 1
t0=$SECONDS
$BIN/jupyter-book build . --builder html -W -n --keep-going >_build/strict-book.log 2>&1 &
book=$!
$BIN/jupyter-book build . --builder html --toc _build/student_toc.yml --path-output _build/student \
  -W -n --keep-going >_build/strict-student.log 2>&1 &
student=$!
wait $book; rc_book=$?
wait $student; rc_student=$?
cat _build/strict-book.log _build/strict-student.log
echo "strict builds: book $([ $rc_book = 0 ] && echo ok || echo FAILED), student edition" \
  "$([ $rc_student = 0 ] && echo ok || echo FAILED) ($((SECONDS - t0)) s side by side)"
[ $rc_book = 0 ] && [ $rc_student = 0 ] || exit 1
record "$tree"
