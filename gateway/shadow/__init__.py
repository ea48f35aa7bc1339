"""Shadow traffic of model groups: copies of real requests sent to a shadow target, measured, never answered.

``runner.py`` decides, places, runs and measures the copies; ``scorers.py`` holds the quality
scorers that compare a shadow's answer with the primary's. Nothing is imported here, so the
policy loader can check a scorer's name (``scorers.scorer_problems``) without loading the runner.
"""
