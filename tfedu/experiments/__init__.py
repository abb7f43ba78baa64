"""The notebooks' experiments: runs that measure a claim (depth, extrapolation, scaling, induction heads, ...).

They may import the reference library (``tfedu.attention``, ``tfedu.model``, ...), never the checks or the course.
"""
