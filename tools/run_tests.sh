#!/usr/bin/env bash
# The whole test suite, as `make test` runs it. Every part runs even when an
# earlier one failed; the script exits non-zero if any part failed.
#
# Speed (issue: `make test` within 3 minutes on a 2-core machine, nothing skipped):
# the unit tests and the notebooks run on every core (pytest-xdist; a notebook's
# cells stay together on one worker, in order, with --dist loadfile); the two
# strict builds run side by side; the browser test opens each page once for all
# the checks made on it (tests/test_browser.py). The hypothesis profile is the
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
# Two parts side by side; each one's output is printed whole when both are done.
two_parts() {
  local name1=$1 cmd1=$2 name2=$3 cmd2=$4 t0=$SECONDS log1 log2
  log1=$(mktemp) log2=$(mktemp)
  echo
  echo "=== $name1 and $name2, side by side"
  ( t=$SECONDS; bash -c "$cmd1" >"$log1" 2>&1; echo "$? $((SECONDS - t))" >"$log1.rc" ) &
  ( t=$SECONDS; bash -c "$cmd2" >"$log2" 2>&1; echo "$? $((SECONDS - t))" >"$log2.rc" ) &
  wait
  for i in 1 2; do
    local name log
    if [ $i = 1 ]; then name=$name1 log=$log1; else name=$name2 log=$log2; fi
    echo
    echo "=== $name: $([ $i = 1 ] && echo "$cmd1" || echo "$cmd2")"
    cat "$log"
    read -r rc secs <"$log.rc"
    report "$name" "$rc" "$secs"
    rm -f "$log" "$log.rc"
  done
  echo "=== (both took $((SECONDS - t0)) s together)"
}

NOTEBOOK_DIRS=()
for d in chapters exercises solutions appendix; do
  [ -d "$d" ] && NOTEBOOK_DIRS+=("$d")
done

# The student kit's installation into fresh environments (-m kit) takes minutes: .ci/run runs it after this.
part "unit tests" $BIN/python -m pytest tests -q -m "not browser and not site and not kit" -p no:cacheprovider \
  -n "$WORKERS"
part "notebooks (nbval)" $BIN/python -m pytest --nbval --nbval-current-env \
  --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=600 -p no:cacheprovider -q \
  -n "$WORKERS" --dist loadfile "${NOTEBOOK_DIRS[@]}"
rm -rf _build/html _build/.doctrees _build/jupyter_execute _build/student
$BIN/python tools/student_toc.py _toc.yml _build/student_toc.yml
two_parts "book build (-W -n --keep-going)" "$BIN/jupyter-book build . --builder html -W -n --keep-going" \
  "student edition build (-W -n --keep-going)" "$BIN/jupyter-book build . --builder html \
  --toc _build/student_toc.yml --path-output _build/student -W -n --keep-going"
part "built site: student-edition and student-kit leak tests, downloads, browser test" $BIN/python -m pytest tests -q \
  -m "site or browser" -p no:cacheprovider

echo
if [ ${#failed[@]} -eq 0 ]; then
  echo "make test: every part passed"
else
  echo "make test: FAILED parts: ${failed[*]}"
fi
# The closing line counts the parts of the suite.
echo "parts: $passed passed, ${#failed[@]} failed"
[ ${#failed[@]} -eq 0 ]
