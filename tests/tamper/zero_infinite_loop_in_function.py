# Loops forever when called (in the check cell and in the hidden test).
def softmax(x):
    while True:
        x = x + 0
