"""Each suite's own machinery, one module (or folder) per suite in suites/, named after it: the shared
measuring core stays in measure/, the decisions in analysis/."""
