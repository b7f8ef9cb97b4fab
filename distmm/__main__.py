from distmm.cli import main

raise SystemExit(main())
