"""Grading the book's exercise notebooks as students hand them in.

``tools/grade.py`` is the command line (``make grade SUBMISSIONS=<folder>``);
this package holds its parts:

- :mod:`grading.book` reads the book's own exercise notebooks: the chapters,
  their exercises, the points of each, the check calls that grade it and the
  rubric of the parts graded by hand;
- :mod:`grading.runner` executes one submitted notebook in a fresh kernel (time
  limits, no network, a memory limit) and then, in that kernel, calls the
  package's checks on the names the student defined;
- :mod:`grading.grader` finds the submissions, tells which chapter each one
  holds and turns check results into points;
- :mod:`grading.report` writes the gradebook, the feedback files and the list of
  answers to grade by hand.
"""
