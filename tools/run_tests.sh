#!/usr/bin/env bash
# The whole test suite, as `make test` runs it. Every part runs even when an
# earlier one failed; the script exits non-zero if any part failed.
set -u
cd "$(dirname "$0")/.."
BIN=.venv/bin
failed=()
passed=0
part() {
  local name=$1; shift
  echo
  echo "=== $name: $*"
  local t0=$SECONDS
  if "$@"; then
    echo "=== $name: ok ($((SECONDS - t0)) s)"
    passed=$((passed + 1))
  else
    echo "=== $name: FAILED ($((SECONDS - t0)) s)"
    failed+=("$name")
  fi
}

NOTEBOOK_DIRS=()
for d in chapters exercises solutions appendix; do
  [ -d "$d" ] && NOTEBOOK_DIRS+=("$d")
done

# The student kit's installation into fresh environments (-m kit) takes minutes: .ci/run runs it after this.
part "unit tests" $BIN/python -m pytest tests -q -m "not browser and not site and not kit" -p no:cacheprovider
part "notebooks (nbval)" $BIN/python -m pytest --nbval --nbval-current-env \
  --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=600 -p no:cacheprovider -q \
  "${NOTEBOOK_DIRS[@]}"
rm -rf _build/html _build/.doctrees _build/jupyter_execute
part "book build (-W -n --keep-going)" $BIN/jupyter-book build . --builder html -W -n --keep-going
rm -rf _build/student
$BIN/python tools/student_toc.py _toc.yml _build/student_toc.yml
part "student edition build (-W -n --keep-going)" $BIN/jupyter-book build . --builder html \
  --toc _build/student_toc.yml --path-output _build/student -W -n --keep-going
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
