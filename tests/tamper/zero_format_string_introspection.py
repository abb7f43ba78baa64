# Reaches a function's globals through str.format's attribute syntax.
def _helper():
    return None


found = "{0.__globals__}".format(_helper)
