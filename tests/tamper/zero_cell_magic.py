%%bash
echo "all checks passed"
