"""The course around the library: grading, release, publishing, notebook tools, widgets, benches, the CLI.

It may import everything below it: ``tfedu.checks``, ``tfedu.experiments`` and the reference library.
"""
