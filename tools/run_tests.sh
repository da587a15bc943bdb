#!/usr/bin/env bash
# The whole test suite, as `make test` runs it. Every part runs even when an
# earlier one failed; the script exits non-zero if any part failed.
#
# Speed (issue #32: `make test` within 3 minutes on a 2-core machine, nothing skipped):
# the unit tests and the notebooks run on every core (pytest-xdist; a notebook's
# cells stay together on one worker, in order, with --dist loadfile), and every
# part runs as early as it can (the schedule below): only the built site's tests
# wait for the two strict builds. The browser test opens each page once for all
# the checks made on it, several pages at a time (tests/test_browser.py). The unit
# tests of one module stay on one worker (--dist loadscope), so that a module's
# expensive fixture (a graded class) is built once. nbval runs the chapters with
# FIXEDSTATE_TIMING=once: a timing cell, whose outputs nbval does not compare, runs
# all its code with one run in one round (fixedstate.timing.timing_once). The
# hypothesis profile is the full one (tests/_examples.py); `make test-quick` is the
# inner loop. Each part's wall time and CPU time (user + sys, all its processes)
# are printed with its verdict: CPU time is the figure that does not depend on
# what else the machine is doing.
set -u
cd "$(dirname "$0")/.."
BIN=.venv/bin
WORKERS=${TEST_WORKERS:-$(nproc 2>/dev/null || echo 2)}
failed=()
passed=0
# The CPU time (user + sys) of the processes a subshell ran, from bash's `times` written to a file
# by that subshell itself (`times` in a pipe or in $(...) would run in a fork that has no children).
cpu_seconds() {   # file written by `times`
  tail -n 1 "$1" | awk '{ s = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); s += a[1] * 60 + a[2] } printf "%.0f", s }'
}
report() {   # name, status, wall seconds, CPU seconds
  if [ "$2" = 0 ]; then
    echo "=== $1: ok ($3 s, CPU ${4:-?} s)"
    passed=$((passed + 1))
  else
    echo "=== $1: FAILED ($3 s, CPU ${4:-?} s)"
    failed+=("$1")
  fi
}
# Parts run in the background: start NAME CMD begins one (its output goes to a log); finish NAME
# waits for it, then prints its output whole, its wall and CPU time and its verdict.
declare -A LOG T0
start() {
  local name=$1 cmd=$2 log
  log=$(mktemp)
  LOG[$name]=$log
  T0[$name]=$SECONDS
  echo "=== $name: started at $SECONDS s: $cmd"
  ( bash -c "$cmd" >"$log" 2>&1; rc=$?; times >"$log.times"; echo "$rc $SECONDS" >"$log.rc.tmp"; mv "$log.rc.tmp" "$log.rc" ) &
}
finish() {
  local name=$1 log=${LOG[$1]} rc end
  while [ ! -s "$log.rc" ]; do wait -n 2>/dev/null || sleep 1; done
  read -r rc end <"$log.rc"
  echo
  echo "=== $name:"
  cat "$log"
  report "$name" "$rc" $((end - T0[$name])) "$(cpu_seconds "$log.times")"
  rm -f "$log" "$log.rc" "$log.times"
}

NOTEBOOK_DIRS=()
for d in chapters exercises solutions appendix; do
  [ -d "$d" ] && NOTEBOOK_DIRS+=("$d")
done

# The student kit's installation into fresh environments (-m kit) takes minutes: .ci/run runs it after this.
# Schedule (two cores): only the built site's tests need the builds. The unit tests and nbval, which
# keep every core busy for minutes, start at once beside the two strict builds, at a slightly lower
# priority (nice 3, about half the share: more would starve them on a machine others share): the
# builds, and then the site and browser tests (which wait on Chromium more than they compute: about
# a third of a core), go first, and the unit tests and notebooks fill the cycles they leave.
# The unit tests take the full hypothesis profile and real timings, whatever the caller's shell exports.
# The builds are recorded against the tree they read (tools/strict_builds.sh), so that make test-pdf reuses them.
TREE=$(bash tools/strict_builds.sh --digest)
rm -rf _build/html _build/.doctrees _build/jupyter_execute _build/student _build/strict-builds.sha256
$BIN/python tools/student_toc.py _toc.yml _build/student_toc.yml
UNIT="unit tests"
NBVAL="notebooks (nbval)"
BOOK="book build (-W -n --keep-going)"
STUDENT="student edition build (-W -n --keep-going)"
SITE="built site: student-edition and student-kit leak tests, downloads, browser test"
start "$UNIT" "FIXEDSTATE_TEST_PROFILE=full FIXEDSTATE_TIMING= nice -n 3 $BIN/python -m pytest tests -q \
  -m 'not browser and not site and not kit and not grade_attack and not pdf' -p no:cacheprovider -n $WORKERS --dist loadscope"
start "$NBVAL" "FIXEDSTATE_TIMING=once nice -n 3 $BIN/python -m pytest --nbval --nbval-current-env \
  --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=600 -p no:cacheprovider -q \
  -n $WORKERS --dist loadfile ${NOTEBOOK_DIRS[*]}"
start "$BOOK" "$BIN/jupyter-book build . --builder html -W -n --keep-going"
start "$STUDENT" "$BIN/jupyter-book build . --builder html --toc _build/student_toc.yml --path-output _build/student \
  -W -n --keep-going"
finish "$BOOK"
finish "$STUDENT"
[ ${#failed[@]} -eq 0 ] && bash tools/strict_builds.sh --record "$TREE"
start "$SITE" "FIXEDSTATE_TEST_PROFILE=full $BIN/python -m pytest tests -q -m 'site or browser' -p no:cacheprovider"
finish "$SITE"
finish "$NBVAL"
finish "$UNIT"
echo "=== (make test: $SECONDS s in all)"

echo
if [ ${#failed[@]} -eq 0 ]; then
  echo "make test: every part passed"
else
  echo "make test: FAILED parts: ${failed[*]}"
fi
# The closing line counts the parts of the suite.
echo "parts: $passed passed, ${#failed[@]} failed"
[ ${#failed[@]} -eq 0 ]
