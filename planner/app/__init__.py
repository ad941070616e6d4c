"""The application shell: the `meshplan` CLI and its verbs, compare, report and the pictures.

The only planner code that imports codegen (tests/unit/test_import_directions.py checks it).
Importing does no work; each verb imports what it needs when it runs.
"""
