"""Grading the book's exercise notebooks as students hand them in.

``tools/grade.py`` is the command line (``make grade SUBMISSIONS=<folder>``);
this package holds its parts:

- :mod:`grading.book` reads the book's own exercise notebooks: the chapters,
  their exercises, the points of each, the check calls that grade it and the
  rubric of the parts graded by hand;
- :mod:`grading.sandbox` and :mod:`grading.launch` seal each notebook's kernel in
  a bubblewrap sandbox (namespaces, read-only system and package, a private
  tmpfs, kernel-enforced limits);
- :mod:`grading.runner` executes one submitted notebook in its sealed kernel
  (time limits, replay after a crash) and sends it the grader's cells;
- :mod:`grading.hidden` holds the hidden cases, drawn per student, with answers
  computed in the grader's process; :mod:`grading.judge` moves them in and the
  student's answers out as plain data, and decides;
- :mod:`grading.grader` finds the submissions, tells which chapter each one
  holds and turns verdicts into points;
- :mod:`grading.course` reads the roster, the late policy and the hand points;
- :mod:`grading.report` writes the gradebook, the Canvas file, the feedback
  files and the list of answers to grade by hand;
- :mod:`grading.attack_class` writes the class of attackers that
  ``make grade-attack-test`` grades next to honest students.
"""
