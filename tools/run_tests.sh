#!/usr/bin/env bash
# The whole test suite, as `make test` runs it. Every part runs even when an
# earlier one failed; the script exits non-zero if any part failed.
#
# Speed (issue: `make test` within 3 minutes on a 2-core machine, nothing skipped):
# the unit tests and the notebooks run on every core (pytest-xdist; a notebook's
# cells stay together on one worker, in order, with --dist loadfile); the two
# strict builds run side by side, and the browser test (about one core) beside
# nbval; the browser test opens each page once for all the checks made on it
# (tests/test_browser.py). The unit tests of one module stay on one worker (--dist
# loadscope), so that a module's expensive fixture (a graded class) is built once.
# nbval runs the chapters with FIXEDSTATE_TIMING=once: a timing cell, whose outputs
# nbval does not compare, runs all its code with one run in one round
# (fixedstate.timing.timing_once). The hypothesis profile is the
# full one (tests/_examples.py); `make test-quick` is the inner loop.
set -u
cd "$(dirname "$0")/.."
BIN=.venv/bin
WORKERS=${TEST_WORKERS:-$(nproc 2>/dev/null || echo 2)}
failed=()
passed=0
report() {   # name, status, seconds
  if [ "$2" = 0 ]; then
    echo "=== $1: ok ($3 s)"
    passed=$((passed + 1))
  else
    echo "=== $1: FAILED ($3 s)"
    failed+=("$1")
  fi
}
part() {
  local name=$1; shift
  echo
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@"
  report "$name" $? $((SECONDS - t0))
}
# Parts side by side: together NAME CMD [NAME CMD ...]. Each part's output is printed whole,
# in the order given, when all are done, with its own time and verdict.
together() {
  local t0=$SECONDS names=() cmds=() logs=() i
  while [ $# -ge 2 ]; do names+=("$1"); cmds+=("$2"); shift 2; done
  echo
  echo "=== side by side: $(IFS=,; echo "${names[*]}")"
  for i in "${!names[@]}"; do
    logs+=("$(mktemp)")
    ( t=$SECONDS; bash -c "${cmds[$i]}" >"${logs[$i]}" 2>&1; echo "$? $((SECONDS - t))" >"${logs[$i]}.rc" ) &
  done
  wait
  for i in "${!names[@]}"; do
    echo
    echo "=== ${names[$i]}: ${cmds[$i]}"
    cat "${logs[$i]}"
    read -r rc secs <"${logs[$i]}.rc"
    report "${names[$i]}" "$rc" "$secs"
    rm -f "${logs[$i]}" "${logs[$i]}.rc"
  done
  echo "=== (side by side, $((SECONDS - t0)) s in all)"
}

NOTEBOOK_DIRS=()
for d in chapters exercises solutions appendix; do
  [ -d "$d" ] && NOTEBOOK_DIRS+=("$d")
done

# The student kit's installation into fresh environments (-m kit) takes minutes: .ci/run runs it after this.
# Order: the two strict builds first (side by side); then the built site's tests, whose browser
# keeps about one core busy, beside nbval; then the unit tests on every core.
rm -rf _build/html _build/.doctrees _build/jupyter_execute _build/student
$BIN/python tools/student_toc.py _toc.yml _build/student_toc.yml
together "book build (-W -n --keep-going)" "$BIN/jupyter-book build . --builder html -W -n --keep-going" \
  "student edition build (-W -n --keep-going)" "$BIN/jupyter-book build . --builder html \
  --toc _build/student_toc.yml --path-output _build/student -W -n --keep-going"
together "built site: student-edition and student-kit leak tests, downloads, browser test" \
  "FIXEDSTATE_TEST_PROFILE=full $BIN/python -m pytest tests -q -m 'site or browser' -p no:cacheprovider" \
  "notebooks (nbval)" "FIXEDSTATE_TIMING=once $BIN/python -m pytest --nbval --nbval-current-env \
  --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=600 -p no:cacheprovider -q \
  -n $WORKERS --dist loadfile ${NOTEBOOK_DIRS[*]}"
# The full hypothesis profile and real timings, whatever the caller's shell exports.
part "unit tests" env FIXEDSTATE_TEST_PROFILE=full FIXEDSTATE_TIMING= $BIN/python -m pytest tests -q \
  -m "not browser and not site and not kit and not grade_attack and not pdf" -p no:cacheprovider -n "$WORKERS" --dist loadscope

echo
if [ ${#failed[@]} -eq 0 ]; then
  echo "make test: every part passed"
else
  echo "make test: FAILED parts: ${failed[*]}"
fi
# The closing line counts the parts of the suite.
echo "parts: $passed passed, ${#failed[@]} failed"
[ ${#failed[@]} -eq 0 ]
