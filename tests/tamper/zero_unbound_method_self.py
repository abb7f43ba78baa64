# Calls a method through its class with torch as `self` (issue 37, class 4): inside a method, attribute
# stores on `self` are trusted, so this would monkeypatch torch.allclose, and the check cell would pass.
class _Settings:
    def set(self, name_value):
        self.allclose = name_value


_Settings.set(torch, lambda *args, **kwargs: True)


def softmax(x):
    return x
