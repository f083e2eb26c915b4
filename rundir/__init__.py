"""A run directory and the files in it: storage at any fsspec URL, local or gs:// (retries,
errors that say what to do, the fence a study's trainer writes under, the test hooks that inject
storage faults), and the contract the fleet reads a run by (exit codes, environment variables,
record files). The bottom floor: it imports nothing else of the project."""
