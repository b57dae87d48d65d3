"""An MLP classifier on scikit-learn's bundled 8x8 handwritten digits, reporting accuracy."""
