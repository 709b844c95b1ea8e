from eagle3.cli import main

main()
